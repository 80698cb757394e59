"""The one-token decode step: which one runs (decoder), one per architecture (steps/), compiled
as AOTInductor packages (package) built away from serving (builder), several rows at once (batch)."""
