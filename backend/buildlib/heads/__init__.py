"""Draft heads as published and as we train them: their readers (formats.py), the EAGLE head
as a 1-layer engine (eagle.py), Medusa heads copied for the host drafter (medusa.py)."""
