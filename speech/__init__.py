"""What a speech request is, for every layer: the job a caller asks for (`speech.job`) and the
sampling settings it runs with (`speech.sampling`). A leaf: it imports nothing of mossvox."""
