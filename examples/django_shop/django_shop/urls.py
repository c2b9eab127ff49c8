from django.contrib import admin
from django.urls import path
from storefront import views

urlpatterns = [
    path("admin/", admin.site.urls),
    path("checkout/<int:order_id>/", views.checkout, name="checkout"),
    path("checkout/<int:order_id>/on-commit/", views.checkout_on_commit, name="checkout-on-commit"),
]
