"""Speculative decoding engine, scheduler and (in ``serve/app.py``) the Ray Serve application."""
