"""Examples built on the public client (:mod:`pyworker.client`); the runtime imports none of them."""
