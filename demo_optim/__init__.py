"""DeMo: decoupled momentum optimization with DCT top-k exchange (in progress)."""
