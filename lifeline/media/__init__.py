"""Images in a request: decoding under limits (`images`) and the families' image processors
(`processors`), which turn an image into the pixel values a vision encoder reads."""
