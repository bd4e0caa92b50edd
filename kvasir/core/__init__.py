"""Domain types shared by every layer: sampling parameters, stop search, prefill schedule, ids, the schema converter."""
