"""One side of an A/B: load engines from a repo checkout, serve timing commands on stdin (JSON lines)."""
import json, sys, threading, time
repo = sys.argv[1]
sys.path.insert(0, repo)
import torch
torch.set_num_threads(1)
from gemma_spec_ros.engine import Engine, EngineConfig, GenerationRequest
models = sys.argv[2] + '/'
prompts = [json.loads(l) for l in open(sys.argv[2] + '/../bench/prompts.jsonl')]
import dataclasses
extra = {'prefix_cache_mb': 0.0} if 'prefix_cache_mb' in {f.name for f in dataclasses.fields(EngineConfig)} else {}
def config(max_batch):
    return EngineConfig(target_path=models + 'gemma4-spec-target', assistant_path=models + 'gemma4-spec-assistant',
                        draft_model_path=models + 'gemma4-spec-draft', drafter='mtp', warmup='blocking', num_threads=1,
                        max_batch=max_batch, **extra)
single = Engine.from_config(config(1))
batched = Engine.from_config(config(4))
print(json.dumps({'ready': True}), flush=True)
for line in sys.stdin:
    cmd = json.loads(line)
    picked = [p['prompt'] for p in prompts if p['category'] == cmd['category']][:cmd['n']]
    if cmd['kind'] == 'single':
        started, tokens, toks, decode_s = time.perf_counter(), 0, [], 0.0
        for prompt in picked:
            r = single.generate(GenerationRequest(prompt=prompt, max_new_tokens=cmd['tokens'], drafter=cmd['drafter']))
            tokens += len(r.token_ids) - 1; toks.append(r.token_ids); decode_s += r.stats.wall_time - r.stats.time_to_first_token
    else:
        results = [None] * len(picked)
        def run(i, prompt):
            results[i] = batched.generate(GenerationRequest(prompt=prompt, max_new_tokens=cmd['tokens'], drafter=cmd['drafter']))
        started = time.perf_counter()
        threads = [threading.Thread(target=run, args=(i, p)) for i, p in enumerate(picked)]
        [t.start() for t in threads]; [t.join() for t in threads]
        tokens = sum(len(r.token_ids) for r in results); toks = [r.token_ids for r in results]
    seconds = time.perf_counter() - started
    if cmd['kind'] == 'single':
        seconds = decode_s   # decode only: a prefix cache would shorten the repeats' prefill on one side
    print(json.dumps({'tok_s': tokens / seconds, 'tokens': toks}), flush=True)
