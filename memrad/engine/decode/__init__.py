"""The one-token decode step: eager, compiled as an AOTInductor package, memra's CPU kernel."""
