"""
What a step does with the logits: grammar masks, sampling and the speculative acceptance rule (torch, no models).

- sampling.py: logits to probabilities (temperature, top-k, top-p), sampling and the greedy pick.
- verify.py: verify, speculative sampling's acceptance rule over a round's drafts (greedy and sampled).
- grammar.py: json_schema / grammar constraints (xgrammar): compiling, token masks, lookahead, and the EBNF the
  vLLM backend sends to its server (constraint_kind, constraint_grammar); ebnf_rules.py refuses an EBNF grammar
  whose root reaches a rule that derives no finite text.
- schema.py: a json_schema read for the grammar (the keywords it cannot enforce refused or left to a final check,
  json_schema_unenforced), the final jsonschema check of the output, the bound on numbers' digits; schema_rewrite.py
  and schema_merge.py rewrite a schema into the forms xgrammar enforces, schema_oneof.py tells oneOf alternatives
  apart, schema_regex.py reads its patterns; schema_unique.py plans the uniqueItems arrays that
  unique_tracker.py keeps distinct beside the grammar (local engine).

Used by the decode loop, the drafters and the runtime (whose verify pass runs verify inside the target's step).
"""
