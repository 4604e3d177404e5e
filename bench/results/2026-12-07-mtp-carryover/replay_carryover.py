import random, sys
sys.path.insert(0, 'test/unit')
from test_adaptive_traces import new_controller, replay, scripted_run_lengths, CODE
for seed in range(5):
    rng = random.Random(seed)
    controller, cost = new_controller()
    replay(controller, cost, scripted_run_lengths(CODE, 100, rng), c=float(sys.argv[1]))
    controller.start()
    r = replay(controller, cost, [0] * 40, c=float(sys.argv[1]))
    ks = [d.num_draft_tokens for d in r.decisions]
    first_pause = next((i for i, d in enumerate(r.decisions) if not d.speculating), None)
    print(seed, 'drafts', sum(ks), 'first pause', first_pause, ks[:30])
