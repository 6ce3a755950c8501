"""The worker fleet: addresses, membership, health and ejection, dispatch, routing, call groups, migration."""
