from django.apps import AppConfig


class StorefrontConfig(AppConfig):
    name = "storefront"
    default_auto_field = "django.db.models.BigAutoField"
