"""The intermediate representation: instructions and Programs, plan types and plan.json, Timelines, the stage graph."""
