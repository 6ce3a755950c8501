"""Prompt rendering: chat messages or a raw prompt to token ids with the model's own chat template
(``prompt.py``), images, fill-in-the-middle, mistral-common's chats, and the model family's formats
chosen at load (``family.py``)."""
