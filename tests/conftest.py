from hypothesis import settings


settings.register_profile("pockjax", deadline=None, max_examples=12, derandomize=True)
settings.load_profile("pockjax")
