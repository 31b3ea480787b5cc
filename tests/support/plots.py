"""Reading back what scripts/serving/load_test.py wrote into its plots."""


def png_title(path: str) -> str:
    from PIL import Image

    with Image.open(path) as image:
        return image.text["Title"]
