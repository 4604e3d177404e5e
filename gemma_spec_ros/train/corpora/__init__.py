"""
What the bundled models learn from: text corpora and their windows, the planner conversations, the vision scenes.

- corpus.py: the default text corpus (Python stdlib and English docs on this machine) or user files.
- data.py: token streams and the windows a training step reads.
- planner.py: synthetic robot-task conversations in Gemma 4's chat format, and the held-out planner evaluation.
- scenes.py: synthetic table scenes with questions, for the bundled vision model.
"""
