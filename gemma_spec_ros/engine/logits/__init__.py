"""
What a step does with the logits: grammar masks, sampling and the speculative acceptance rule (torch, no models).

- sampling.py: logits to probabilities (temperature, top-k, top-p), sampling and the greedy pick.
- verify.py: verify, speculative sampling's acceptance rule over a round's drafts (greedy and sampled).
- grammar.py: json_schema / grammar constraints (xgrammar): compiling, token masks, lookahead, and the EBNF the
  vLLM backend sends to its server (constraint_kind, constraint_grammar).

Used by the decode loop, the drafters and the runtime (whose verify pass runs verify inside the target's step).
"""
