"""The recommended production configuration (docs/guides/production.md)."""
