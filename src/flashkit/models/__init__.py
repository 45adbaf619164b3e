"""Models built on flashkit's attention: a small GPT with pluggable attention (`gpt`)."""
