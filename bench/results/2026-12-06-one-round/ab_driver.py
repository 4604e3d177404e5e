"""Interleaved A/B of two checkouts: single-goal and batched (4 goals) tok/s by drafter, alternating order."""
import json, statistics, subprocess, sys
sides = {'before': sys.argv[1], 'after': sys.argv[2]}
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 4
procs = {}
for name, repo in sides.items():
    procs[name] = subprocess.Popen([sys.executable, '/tmp/ab_worker.py', repo, '/work/main/models'], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, text=True, cwd=repo)
    while True:
        line = procs[name].stdout.readline()
        if line.startswith('{') and 'ready' in line:
            break
        if not line:
            sys.exit('worker {} died'.format(name))
cases = [dict(kind='single', drafter=d, category=c, n=3, tokens=96) for d in ('none', 'mtp', 'ngram')
         for c in ('code', 'explain')] + [dict(kind='batch', drafter=d, category='code', n=4, tokens=96) for d in ('none', 'mtp')]
out = {json.dumps(c): {n: [] for n in sides} for c in cases}
same = True
for r in range(rounds):
    for c in cases:
        order = list(sides) if r % 2 == 0 else list(sides)[::-1]
        tokens = {}
        for name in order:
            procs[name].stdin.write(json.dumps(c) + '\n'); procs[name].stdin.flush()
            reply = json.loads(procs[name].stdout.readline())
            out[json.dumps(c)][name].append(reply['tok_s']); tokens[name] = reply['tokens']
        same &= tokens['before'] == tokens['after']
print('identical tokens:', same)
print('| case | before tok/s | after tok/s | after/before (median of pairs) |')
print('|---|---|---|---|')
for key, v in out.items():
    c = json.loads(key)
    ratios = [a / b for a, b in zip(v['after'], v['before'])]
    print('| {} {} {} | {:.0f} | {:.0f} | {:.3f} |'.format(c['kind'], c['drafter'], c['category'], statistics.median(v['before']),
          statistics.median(v['after']), statistics.median(ratios)))
for p in procs.values():
    p.stdin.close(); p.wait()
