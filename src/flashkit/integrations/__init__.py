"""flashkit inside other frameworks: `flashkit.integrations.transformers.register()` makes it
an attention implementation of Hugging Face transformers."""
