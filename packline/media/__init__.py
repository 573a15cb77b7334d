"""Media files as the pipeline reads them: a video's header facts (what an exact length
needs), the decode check prepare runs, frame decoding and writing, through PyAV
(``video.py``). The image geometry the processor resizes with is Qwen's
(``packline/qwen/vision.py``)."""
