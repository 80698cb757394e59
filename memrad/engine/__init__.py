"""The only package that imports torch and transformers modelling code."""
