"""The audio each client asked for: rate, speed, prosody, encoding, and the words' times in it."""
