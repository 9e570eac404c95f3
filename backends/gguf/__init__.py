"""GGUF: llama.cpp's file format (file-only backend)."""
