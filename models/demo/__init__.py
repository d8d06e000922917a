"""The built-in model and the world it was trained on.

scenes.py    pictures of coloured shapes, and questions about them with exact answers
train.py     train a tiny Qwen2.5-VL on them with our own model code; measure accuracy
builtin/     the trained checkpoint `epd up` serves by default (package data)

speech.py        sentences about the shapes spoken by espeak-ng, word by word, with their alignment
train_speech.py  train a tiny Voxtral Realtime to transcribe them; measure word accuracy
speech/          the trained speech checkpoint (`epd up --model models/demo/speech`)
"""

from pathlib import Path

BUILTIN_DIR = Path(__file__).resolve().parent / "builtin"
SPEECH_DIR = Path(__file__).resolve().parent / "speech"
