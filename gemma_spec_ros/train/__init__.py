"""Training tools for the bundled models: tokenizer, target, draft model and MTP assistant."""
