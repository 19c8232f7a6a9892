"""The MOSS-TTS "Delay" talker family: MOSS-TTS 8B, MOSS-TTSD, MOSS-SoundEffect, MOSS-VoiceGenerator."""
