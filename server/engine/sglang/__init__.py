"""The `Engine` over HTTP to an SGLang runtime that runs the dialspec plugin (no torch).

client.py     `SGLangEngine`: requests out, capabilities refused rather than dropped.
stream.py     SGLang's `/generate` stream -> dialspec chunks and stats.
readiness.py  the w = 0 probe that proves the plugin's hooks are live (behind `/ready`).
"""
