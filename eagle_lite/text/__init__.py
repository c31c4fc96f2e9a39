"""Text in and out of a target: prompts through its chat template (`chat_format`), and streamed answers decoded a
short window at a time (`detokenize`)."""
