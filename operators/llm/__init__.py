"""The LLM layer shared by every language step (captions, QA, judging)."""
