"""The model: building it, its loss, devices and precision, b_max, exporting it to Hugging Face."""
