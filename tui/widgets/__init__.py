"""Widgets by screen region: sessions (top left), chains (top right), decisions and TTFT (bottom)."""
