"""A request's text as the engine takes it: SSML, a long input's parts, sentence units."""
