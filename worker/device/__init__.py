"""Host <-> device copies that do not block the host, and the fence waited on before reading their
results (``staging.py``); shared by attention, the model's step inputs and the sampler."""
