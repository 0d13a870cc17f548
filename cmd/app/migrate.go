package main

import "context"

type migrateCmd struct {
	DB dbSettings `embed:""`
}

func (m *migrateCmd) Run(ctx context.Context, d deps) error {
	pool, err := m.DB.connect(ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	return migrate(ctx, pool, d)
}
