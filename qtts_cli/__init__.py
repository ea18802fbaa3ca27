"""`qtts-jax`, the command line: the top layer, so the library (`qtts_jax`) never imports the applications
(`serving`, `studies`) whose commands it assembles."""
