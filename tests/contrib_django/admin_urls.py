"""The admin alone, for the admin's tests (the example's URLconf loads its Celery app)."""

from django.contrib import admin
from django.urls import path

urlpatterns = [path("admin/", admin.site.urls)]
