"""Images and video clips to model input: decoding, sRGB, resizing, frame sampling, patches."""
