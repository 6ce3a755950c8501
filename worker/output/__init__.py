"""Token ids to events, per request and off the model thread: detokenizing, stop strings, reasoning
and tool-call parsing, finish reasons and usage."""
