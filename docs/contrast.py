"""A held-out reward for the README's demo: pixel contrast (the std of the pixel values, about 0.1-0.3).
JPEG compressibility rewards flat images, so while the training reward rises this one falls: the picture of
reward hacking that a held-out evaluation is there to show."""


def contrast(images, prompts):
    return images.flatten(1).std(1)
