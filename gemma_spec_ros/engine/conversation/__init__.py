"""
Gemma 4's conversation: its control tokens, tool declarations and calls, thinking, and the parts of a reply.

Pure Python (no torch, no xgrammar): the request rules, both backends and the decoding loop read it. The token
masks that keep a reply well formed live in logits.reply.
"""
