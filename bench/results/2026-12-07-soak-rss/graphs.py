"""Build the warm-up's graphs one by one (no ROS): what each adopted graph adds to the process."""
import collections, ctypes, gc, json, os, sys, time, tracemalloc
import torch
torch.set_num_threads(1)
from gemma_spec_ros.engine.config_file import load_engine_config
from gemma_spec_ros.engine import Engine

N = int(sys.argv[1]) if len(sys.argv) > 1 else 8
TRACE = os.environ.get('TRACE', '') == '1'
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ('arena', 'ordblks', 'smblks', 'hblks', 'hblkhd', 'usmblks', 'fsmblks', 'uordblks', 'fordblks', 'keepcost')]
libc = ctypes.CDLL(None); libc.mallinfo2.restype = MallInfo2
def rss():
    for line in open('/proc/self/status'):
        if line.startswith('VmRSS'): return int(line.split()[1]) / 1024
def state(label):
    gc.collect(); libc.malloc_trim(0)
    m = libc.mallinfo2()
    print('%-40s rss %7.1f inuse %6.1f free %5.1f mmap %6.1f gc %d' % (label[:40], rss(), m.uordblks/2**20, m.fordblks/2**20, m.hblkhd/2**20, len(gc.get_objects())), flush=True)

config = load_engine_config('/work/main/config/orin.yaml', {'device': 'cpu', 'max_batch': 4, 'warmup': 'background'})
engine = Engine.from_config(config, progress=lambda m: None, start_warmup=False)
engine.warmup._compile_process_config = None
state('loaded')
types0 = collections.Counter(type(o).__name__ for o in gc.get_objects())
if TRACE:
    tracemalloc.start(6)
snap0 = None
for i in range(N):
    t = time.time()
    name = engine.warmup._most_wanted().name
    engine.warmup.build_next()
    engine.adopt_built_graphs()
    state('%d %s (%.0fs)' % (i + 1, name, time.time() - t))
    if TRACE and i == 0:
        snap0 = tracemalloc.take_snapshot()
types1 = collections.Counter(type(o).__name__ for o in gc.get_objects())
print('types grown:', sorted(((types1[k] - types0.get(k, 0), k) for k in types1 if types1[k] - types0.get(k, 0) > 200), reverse=True)[:25])
if TRACE:
    snap = tracemalloc.take_snapshot()
    for s in snap.compare_to(snap0, 'traceback')[:15]:
        print(round(s.size_diff / 2**20, 2), 'MiB', s.count_diff)
        for fr in list(s.traceback)[-6:]:
            print('      ', fr.filename.split('site-packages/')[-1], fr.lineno)
# who holds StackSummary / FrameSummary
import traceback as tb
objs = [o for o in gc.get_objects() if type(o).__name__ == 'StackSummary'][:3]
for o in objs:
    refs = gc.get_referrers(o)
    print('StackSummary referrers:', [type(r).__name__ for r in refs][:6])
    for r in refs[:2]:
        rr = gc.get_referrers(r)
        print('   2nd:', [type(x).__name__ + (':' + str(list(x.keys())[:5]) if isinstance(x, dict) else '') for x in rr][:5])
sys.stdout.flush()
os._exit(0)
