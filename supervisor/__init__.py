"""sglang-supervisor: owns an SGLang server, reads why it died, relaunches it the right way."""

__version__ = "0.1.0"
