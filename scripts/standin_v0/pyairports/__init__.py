"""Stand-in for ``pyairports``: PyPI's release of it ships no module (only ``sample``/``tests``),
yet outlines 0.0.46 imports ``pyairports.airports`` when vLLM 0.6.3 builds its first guided
decoding processor, so without this a chat request with a schema is a 500. No airport names:
outlines' ``Airport`` type is then an empty enumeration, which nothing of ours uses."""
