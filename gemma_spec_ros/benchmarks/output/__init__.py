"""
Measurements of what the engine writes: constrained JSON, the schema corpus, planner conversations, image goals.

constrained, schemas and planner run from the main bench's --constrained, --schemas and --planner; grammar_timing
and images are studies (``bench grammar-timing``, ``bench images``).
"""
