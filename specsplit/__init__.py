"""specsplit: disaggregated EAGLE-3 speculative decoding — the packages both services and the gateway share."""
