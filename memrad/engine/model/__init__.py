"""Getting a model in: the catalog of named models, pull, loading, hardware choices, quantised
weights, its prefill attention. Kept empty: `memrad start`'s parent imports `pull` without torch."""
