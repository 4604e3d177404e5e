import time, sys
import torch
torch.set_num_threads(1)
from gemma_spec_ros.engine import Engine, EngineConfig, GenerationRequest
from gemma_spec_ros.benchmarks.prompts import default_prompts_path, load_prompts, take_per_category
DR = sys.argv[1] if len(sys.argv) > 1 else 'mtp'
eng = Engine.from_config(EngineConfig(target_path='models/gemma4-spec-target', assistant_path='models/gemma4-spec-assistant',
      draft_model_path='models/gemma4-spec-draft', drafter='none', device='cpu', dtype='float32', compile='auto',
      num_threads=1, warmup='blocking', max_new_tokens_limit=2048))
print('calibrated shape ms', [round(x*1e3,3) if x else None for x in eng.controller('mtp').target_cost.relative()], flush=True)
prompts = take_per_category(load_prompts(default_prompts_path()), 2)
tok = eng.tokenizer
def gen(dr, ids):
    times = []
    def on_delta(d):
        if d.token_ids:
            times[1:] = [time.perf_counter()]
            if len(times) == 1: times.insert(0, times[0])
    r = eng.generate(GenerationRequest(prompt_ids=ids, max_new_tokens=96, drafter=dr), on_delta=on_delta)
    return (len(r.token_ids) - 1) / (times[-1] - times[0]), r.stats.tau
for rep in range(1):
  for p in prompts:
    ids = tok(p.text).input_ids
    plain, _ = gen('none', ids)
    spec, tau = gen(DR, ids)
    c = eng.controller(DR)
    shape = c.target_cost.relative()
    load = c.target_cost.load
    print('%-22s plain %6.0f %s %6.0f (x%.2f) tau %.2f | ctrl: overhead %.3f ms, verify1 %.3f ms, verify5 %.3f ms, draft/tok %.3f ms, pred plain %.0f pred best %.0f (x%.2f) speculating %s' % (
        p.id, plain, DR, spec, spec/plain, tau, c.costs.overhead*1e3, shape[1]*1e3, shape[5]*1e3,
        (c.costs.draft_cost.per_token() or 0)*1e3, c.expected_rate(0) or 0, c.expected_rate() or 0,
        (c.expected_rate() or 0)/(c.expected_rate(0) or 1), c.speculating), flush=True)
    print('   shape ms', [round(x*1e3,3) if x else None for x in shape], 'load %.2f' % load, flush=True)
