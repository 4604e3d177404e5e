"""Decode tok/s and tau of plain and MTP-adaptive decoding on the bundled models with whatever gemma_spec_ros is first on sys.path."""
import json, sys, statistics, torch
import gemma_spec_ros
from gemma_spec_ros.engine import Engine, EngineConfig, GenerationRequest
torch.set_num_threads(1)
repo = sys.argv[1]
prompts = [json.loads(line)['prompt'] for line in open(repo + '/bench/prompts.jsonl')][:int(sys.argv[2])]
engine = Engine.from_config(EngineConfig(target_path=repo + '/models/gemma4-spec-target', assistant_path=repo + '/models/gemma4-spec-assistant',
                                         draft_model_path=repo + '/models/gemma4-spec-draft', drafter='mtp', device='cpu', dtype='float32',
                                         num_threads=1, warmup='blocking'))
out = {'code': gemma_spec_ros.__file__}
for drafter in ('none', 'mtp'):
    rates, taus, tokens = [], [], []
    for prompt in prompts:
        engine.generate(GenerationRequest(prompt=prompt, max_new_tokens=8, drafter=drafter))
        r = engine.generate(GenerationRequest(prompt=prompt, max_new_tokens=96, drafter=drafter))
        rates.append(r.stats.tokens_per_second); taus.append(r.stats.tau); tokens.append(tuple(r.token_ids))
    out[drafter] = {'tok_s_median': statistics.median(rates), 'tok_s_mean': statistics.mean(rates), 'tau_mean': statistics.mean(taus)}
    out[drafter + '_tokens_hash'] = hash(tuple(tokens))
print('RESULT ' + json.dumps(out), flush=True)
