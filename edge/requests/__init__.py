"""Below the surfaces: what every request goes through (the wire models' bases, body validation,
the operator's limits) and the error body each surface answers a failed request with."""
