"""
Fault finding: what the node and the engine do with what they should never be handed, and with what goes wrong.

suite (``bench faults``): every fault the node must survive, one after another, as one table. fuzz (``bench fuzz``,
``python -m gemma_spec_ros.benchmarks.faults.fuzz --cases N``): random Generate goals (every field of
gemma_spec_msgs/action/Generate, extreme values, random bytes and unicode) through a goal's planning, each one
planned or refused naming its field, none an internal error; its strategies are the ones test/engine/test_fuzz_goals.py
runs through the node's whole path.
"""
