"""The target model: its plan (layers, numbering), LM head, attention backend choice."""
