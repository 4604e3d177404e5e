"""Run the gemma_spec node in-process with a sampler thread writing memory figures as JSON lines (PROBE_OUT)."""
import collections, ctypes, gc, json, os, sys, threading, time, tracemalloc

OUT = os.environ.get('PROBE_OUT', '/tmp/soak-probe/probe.jsonl')
PERIOD = float(os.environ.get('PROBE_PERIOD', '30'))
TRACE = int(os.environ.get('PROBE_TRACEMALLOC', '0'))   # frames; 0 = off
TRIM = os.environ.get('PROBE_TRIM', '') == '1'          # malloc_trim(0) at each sample (RSS before/after)
TYPES_EVERY = int(os.environ.get('PROBE_TYPES_EVERY', '4'))

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ('arena', 'ordblks', 'smblks', 'hblks', 'hblkhd', 'usmblks',
                                               'fsmblks', 'uordblks', 'fordblks', 'keepcost')]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2

def proc_status():
    out = {}
    with open('/proc/self/status') as f:
        for line in f:
            k, _, v = line.partition(':')
            if k in ('VmRSS', 'RssAnon', 'RssFile', 'RssShmem', 'VmHWM', 'Threads'):
                out[k] = int(v.split()[0]) / (1024 if k != 'Threads' else 1)
    return out

def mall():
    m = libc.mallinfo2()
    return {'arena': m.arena / 2**20, 'mmap': m.hblkhd / 2**20, 'mmap_n': m.hblks, 'inuse': m.uordblks / 2**20,
            'free': m.fordblks / 2**20, 'topfree': m.keepcost / 2**20, 'ordblks': m.ordblks}

NODE = []
import gemma_spec_ros.ros.node as node_mod
_init = node_mod.GemmaSpecNode.__init__
def _wrapped(self, *a, **k):
    NODE.append(self)
    _init(self, *a, **k)
node_mod.GemmaSpecNode.__init__ = _wrapped

def prefix():
    try:
        b = NODE[0].backend
        caches = getattr(b, '_prefix_caches', [])
        return [(c.stats().blocks, round(c.stats().nbytes / 2**20, 2), c.stats().evictions, c.stats().lookups) for c in caches]
    except Exception as e:  # noqa
        return repr(e)

def warm():
    try:
        w = NODE[0].backend.status().warmup
        return [w.graphs_ready, w.graphs_total, w.done]
    except Exception as e:  # noqa
        return repr(e)[:60]

def sampler():
    start = time.monotonic()
    base_snap = None
    base_types = None
    n = 0
    with open(OUT, 'a') as f:
        while True:
            time.sleep(PERIOD)
            n += 1
            row = {'t': round(time.monotonic() - start, 1), **proc_status(), 'mall': mall(), 'prefix': prefix(),
                   'gc_objects': len(gc.get_objects()) if os.environ.get('PROBE_GC', '1') == '1' else -1, 'warm': warm()}
            if TRIM:
                before = row['VmRSS']
                libc.malloc_trim(0)
                row['rss_after_trim'] = proc_status()['VmRSS']
                row['trimmed'] = round(before - row['rss_after_trim'], 1)
            if n % TYPES_EVERY == 0 and os.environ.get('PROBE_GC', '1') == '1':
                counts = collections.Counter(type(o).__name__ for o in gc.get_objects())
                if base_types is None:
                    base_types = counts
                else:
                    diff = {k: counts[k] - base_types.get(k, 0) for k in counts}
                    row['threads'] = sorted(collections.Counter(t.name.rstrip('0123456789') for t in threading.enumerate()).items())
                    row['types_grown'] = sorted(((v, k) for k, v in diff.items() if v > 50), reverse=True)[:15]
            if TRACE:
                row['traced_mib'] = round(tracemalloc.get_traced_memory()[0] / 2**20, 2)
                if n % TYPES_EVERY == 0:
                    snap = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])
                    if base_snap is None:
                        base_snap = snap
                    else:
                        stats = snap.compare_to(base_snap, 'traceback' if TRACE > 1 else 'lineno')[:12]
                        row['trace_top'] = [[round(s.size_diff / 2**20, 3), s.count_diff,
                                             ' <- '.join('{}:{}'.format(fr.filename.split('gemma_spec_ros/')[-1].split('site-packages/')[-1], fr.lineno) for fr in list(s.traceback)[:TRACE])] for s in stats]
            f.write(json.dumps(row) + '\n')
            f.flush()

if TRACE:
    tracemalloc.start(TRACE)
threading.Thread(target=sampler, daemon=True).start()
from gemma_spec_ros.ros.main import main
code = main(sys.argv[1:]); sys.stdout.flush(); os._exit(code)
