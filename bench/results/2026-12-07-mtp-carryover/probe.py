"""Predicted vs emitted tokens and seconds per round of the MTP (or another) drafter's controller."""
import sys, time, json
from gemma_spec_ros.engine import Engine, EngineConfig, GenerationRequest
from gemma_spec_ros.engine.control.controller import SpeculationController
from gemma_spec_ros.engine.stats import expected_tokens
from gemma_spec_ros.benchmarks.prompts import load_prompts, default_prompts_path, take_per_category

drafter = sys.argv[1] if len(sys.argv) > 1 else 'mtp'
per_cat = int(sys.argv[2]) if len(sys.argv) > 2 else 2
log = []
orig_decide, orig_record = SpeculationController.decide, SpeculationController.record

def decide(self):
    d = orig_decide(self)
    shape = self.target_cost.relative()
    curve = self.acceptance.position_alpha()
    cost = self.costs.round(d.num_draft_tokens, shape)
    tok = expected_tokens(curve, d.num_draft_tokens)
    self._probe = (d.num_draft_tokens, tok, cost, self.acceptance.state, list(curve[:4]), self.rates.gain())
    return d

def record(self, num_drafted, num_accepted, draft_seconds, *, confidences=None, round_seconds=None):
    p = getattr(self, '_probe', None)
    if p is not None:
        log.append(dict(ovh=(round_seconds or 0) - draft_seconds - (self.target_cost.last_seconds or 0), load=self.target_cost.load,
                        shape1=self.target_cost.relative()[1], ctl_ovh=self.costs.overhead, k=p[0], pred_tok=p[1], pred_cost=p[2], state=p[3], curve=p[4], gain=p[5],
                        drafted=num_drafted, emitted=num_accepted + 1, draft_s=draft_seconds,
                        target_s=self.target_cost.last_seconds, round_s=round_seconds))
        self._probe = None
    return orig_record(self, num_drafted, num_accepted, draft_seconds, confidences=confidences, round_seconds=round_seconds)

SpeculationController.decide, SpeculationController.record = decide, record
engine = Engine.from_config(EngineConfig(target_path='models/gemma4-spec-target', assistant_path='models/gemma4-spec-assistant',
    draft_model_path='models/gemma4-spec-draft', drafter='none', device='cpu', dtype='float32', compile='eager',
    num_threads=1, warmup='blocking', max_new_tokens_limit=2048))
prompts = take_per_category(load_prompts(default_prompts_path()), per_cat)
tok = engine.tokenizer
out = []
for prompt in prompts:
    ids = tok(prompt.text).input_ids
    for system in ('none', drafter):
        start = len(log)
        t = time.perf_counter()
        r = engine.generate(GenerationRequest(prompt_ids=ids, max_new_tokens=128, drafter=system))
        wall = time.perf_counter() - t
        rounds = log[start:]
        out.append(dict(prompt=prompt.id, system=system, tokens=len(r.token_ids), wall=wall, rounds=rounds))
        spec = [x for x in rounds if x['k'] > 0]
        if system != 'none':
            pt = sum(x['pred_tok'] for x in spec); at = sum(x['emitted'] for x in spec)
            print('{:28s} {:5s} toks {:4d} wall {:6.2f}s rounds {:3d} spec {:3d} pred_tok/round {:.2f} emitted/round {:.2f} '
                  'pred_cost {:.4f} actual {:.4f} gain@first {}'.format(
                prompt.id, system, len(r.token_ids), wall, len(rounds), len(spec), pt / max(1, len(spec)), at / max(1, len(spec)),
                sum(x['pred_cost'] or 0 for x in spec) / max(1, len(spec)),
                sum((x['round_s'] or 0) for x in spec) / max(1, len(spec)),
                '{:.2f}'.format(spec[0]['gain']) if spec and spec[0]['gain'] else None), flush=True)
            import statistics as st
            o0 = [x['ovh'] for x in rounds if x['drafted'] == 0]; o1 = [x['ovh'] for x in rounds if x['drafted'] > 0]
            last = rounds[-1] if rounds else None
            if last:
                print('   overhead/round measured plain {} spec {} ; controller overhead {:.5f} x load {:.2f}; shape1 {:.5f}; pred plain s/tok {:.5f} actual plain s/tok {:.5f}'.format(
                    '%.5f (%d)' % (st.median(o0), len(o0)) if o0 else '-', '%.5f (%d)' % (st.median(o1), len(o1)) if o1 else '-',
                    last['ctl_ovh'], last['load'], last['shape1'], (last['shape1'] + last['ctl_ovh']) * last['load'], plain_wall / max(1, plain_toks)), flush=True)
        else:
            plain_wall, plain_toks = wall, len(r.token_ids)
            print('{:28s} {:5s} toks {:4d} wall {:6.2f}s'.format(prompt.id, system, len(r.token_ids), wall), flush=True)
json.dump(out, open('mtp_pred_%s.json' % drafter, 'w'))
